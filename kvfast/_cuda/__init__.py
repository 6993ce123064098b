"""GPU launchers of kvfast (CuPy RawKernels over ``kvfast/kernels/*.cu``).

CuPy is imported lazily, in one place (:func:`kvfast._cuda._module.cupy`), so
``import kvfast`` works on a machine without a GPU. Modules:

* ``append_kv``, ``gather_kv``, ``copy_blocks``, ``stage``, ``state``: one
  launcher per kernel family (they check the layouts their kernels assume);
* ``page_store``: :class:`CudaPageStore`, the tiers' view of a device buffer
  (``stage.cu`` + pinned host memory);
* ``convert``: inputs to device storage as kvref converts them (bfloat16
  rounding to ``ml_dtypes``' bits);
* ``harness``: the ``.cu`` sources compiled for the host with a CUDA shim and
  run over the whole grid through ctypes (CI executes every kernel);
* ``emulate``: the CPU stand-in for CuPy selected by ``KVFAST_CUDA_EMULATE=1``;
* ``_nvrtc``: the NVRTC compile check.
"""
