"""Model families: hyper-parameters (`config`), shared layers (`layers`), one module per family, and the tensor
table that turns a model file's tensors into the weights a block takes (`weights`)."""
