"""The gpuswap command line."""
