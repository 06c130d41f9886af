"""Quantized weights as checkpoints ship them (block FP8, per-channel FP8/INT8, grouped INT4/INT8 with zero points),
kept quantized in device memory and dequantized inside the matmul (qarray.py). Reading each checkpoint format into
them is convert/quantized.py's job."""
