"""tsgen: a code generator for multi-GPU communication kernels.

A YAML spec is validated into a typed model, planned by its op family,
rendered through Jinja2 into one CUDA source (it includes tsgen's CUDA
headers; `tsgen build --amalgamate` inlines them) plus a JSON manifest,
compiled with nvcc and run on several GPUs through CuPy.
"""

__version__ = "0.1.0"
