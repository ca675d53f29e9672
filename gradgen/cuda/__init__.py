"""gradgen's CUDA runtime (imports PyCUDA: only the CUDA path imports this package)."""
