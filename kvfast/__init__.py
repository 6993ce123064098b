"""kvfast: the fast path of kvcache (Numba on the CPU, CuPy/Numba-CUDA on a GPU).

Same public names and observable results as ``kvref``.
"""

__version__ = "0.1.0"
