"""Load policies: before a layer's read is submitted, a policy says what to load (everything, nothing, or a
subset of rows), and after the layer computes it is told what was observed."""
