"""The bench wing: `tsgen bench` for every op, with numbers that cannot lie.

  timing.py     the timing core (events on the streams the calls run on, warm-up, median and
                spread, CUDA graphs, the witness / region / call-counter checks), for tsgen's
                calls and every baseline alike
  ceilings.py   ceilings per device (matrix rate, HBM, NVLink; with sources) and the guard
  runner.py     one spec at many sizes in one World: inputs, rotation, timing, the check of
                the timed outputs, errors instead of rows
  baselines.py  the baselines ops name in their conventions (tsgen/ops/conventions.py): in this
                process (cudaMemcpyPeer, cuBLAS) or one process per GPU (nccl.py, torch_ops.py,
                started by workers.py under `tsgen launch`)
  suites.py     suites/NAME.yaml: specs x variants x sizes
  results.py    results/<op>/<suite>/<date>-<commit>.{json,md} with the environment
  index.py      newest run per suite, results/latest.md, the performance tables (docs/benchmarks.md), the archive
  report.py     tables and plots; legacy.py reads result files written before this bench
  cli.py        `tsgen bench`, `tsgen results`
"""

from .runner import CONTROLS, SHARED_NOTE, Outcome, bench_spec
from .sizes import human, parse_size, parse_sizes

__all__ = ["CONTROLS", "SHARED_NOTE", "Outcome", "bench_spec", "human", "parse_size", "parse_sizes"]
