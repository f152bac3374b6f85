"""Communication plans (the comm_plan of a collective) as data, verified and lowered to C.

A collective's plan says, for every rank, what each block of the kernel
does, in order: wait for signals, copy or reduce one slice of memory (its
share of a step), raise signals. The generated kernel is an interpreter of
exactly this table (rendered as a __constant__ array), or for a small plan
straight-line code making the same share calls, and `tsgen verify`
executes the same table on the CPU under many interleavings of ranks and
blocks, so what is verified is what runs.

Memory is named by Slice: a buffer, an offset in units of the run-time
`count`, and a piece of that unit (a unit split into `pieces` parts with
16-byte aligned boundaries). Signals are u64 counters that only grow: a
wait in call `epoch` waits until the counter reaches epoch x (the number of
adds the counter receives per call), which the plan computes, so every
wait is matched by construction and nothing is reset between calls.

The package, by what each part does with a plan:

- tsgen.plan.ir: the plan itself (Slice, SignalRef, Step, Share, RankPlan, CommPlan) and
  `schedule`, which splits steps into block shares; the table limits (MAX_SRCS ...).
- tsgen.plan.verifier: executing plans on the CPU under many schedules (`verify`);
  `tsgen verify` over spec files (`plan_jobs`, `verify_jobs`, `verify_specs`) loads specs and
  so lives above the package, in tsgen/plan_jobs.py: nothing here imports tsgen above plan/.
- tsgen.plan.lower: the C lowering: table rows (`c_tables`, `c_slice`), straight-line
  share groups, and copy-engine stream programs.
"""
