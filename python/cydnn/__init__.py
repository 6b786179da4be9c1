"""cydnn: a small deep-learning framework on cuDNN and cuBLAS (provisional __init__, filled by the core)."""
