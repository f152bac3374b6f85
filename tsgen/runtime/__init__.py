"""Running generated kernels: World (GPUs + backend), Module, Buffers."""

from .world import Buffers, Module, World, check_array, layout

__all__ = ["World", "Module", "Buffers", "check_array", "layout"]
