"""Compute on encoded weights: dequantization (`quant`), the Rust CPU kernels (`cpu_kernels`), and `ops`, the one
op module the model graph calls."""
