"""GPU launchers of kvfast (CuPy RawKernels over ``kvfast/kernels/*.cu``).

CuPy is imported lazily, in one place (:func:`kvfast._cuda._module.cupy`), so
``import kvfast`` works on a machine without a GPU.
"""
