"""tsgen kernels inside PyTorch (`pip install ".[torch]"`): torch ops on your process group.

    import torch, torch.distributed as dist, tsgen.torch
    dist.init_process_group("nccl"); torch.cuda.set_device(local_rank)    # under torchrun
    ag = tsgen.torch.load("specs/allgather.yaml")                         # this rank's op, default group
    rs = tsgen.torch.load("specs/reduce_scatter.yaml")
    tsgen.torch.pair(ag, rs)                                              # each is the other's backward
    y = ag(x)                  # torch.ops.tsgen.allgather(x, group_name): (n, ...) -> (W*n, ...)
    x = ag.empty(n, 1024)      # an input in the symmetric heap: no copy in
    ag(x, out=ag.empty_out(x.shape))   # the out= form: into the heap's output slot, no copy out
    attn = tsgen.torch.attention("specs/attention_hd128.yaml", "specs/attention_backward_hd128.yaml")
    o = attn(q, k, v)          # one GPU, no group: tsgen's flash attention, its backward tsgen's too
    cp = tsgen.torch.cp_attention(fwd_spec, bwd_spec, "specs/allgather.yaml", "specs/reduce_scatter.yaml")
    o = cp(q, k, v)            # context parallel on the group: this rank's rows (zig-zag), differentiable

docs/torch.md has the whole story: what a call costs, the out= form, CUDA graphs, torch.compile, errors.
Importing tsgen never imports torch; importing tsgen.torch without torch says what to install.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised by tests/test_torch_cpu.py in a subprocess
    raise ImportError(f"tsgen.torch needs PyTorch (>= 2.4): pip install '.[torch]' ({_e})") from None

from .attention_op import AttentionOp, AttentionSignature, attention  # noqa: E402
from .cp_attention_op import CPAttentionOp, cp_attention  # noqa: E402
from .ops import ModuleOps, TorchOp, close_all, load, loaded, pair, synchronize  # noqa: E402
from .signature import OpSignature, ShapedSignature, TsgenArgumentError, TsgenTorchError  # noqa: E402

__all__ = ["load", "pair", "attention", "cp_attention", "synchronize", "loaded", "close_all", "TorchOp", "ModuleOps",
           "AttentionOp", "CPAttentionOp", "AttentionSignature", "OpSignature", "ShapedSignature",
           "TsgenTorchError",
           "TsgenArgumentError"]
