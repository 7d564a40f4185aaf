"""The programs that run a graded answer's code, each in a process of its own (in the grader's
sandbox where it has one), never in the process that checks it.

A check copies this folder, as `programs/`, into the folder of each process it starts, with an
`answer.json` beside it (the answer's source, the names of its functions or classes that the check
calls, the packages an answer may not import) and, for a rank, the `secret.json` it alone is dealt.
In the sandbox neither the checkout nor vramlab is visible, so nothing here imports vramlab: the
standard library and torch only. `vramlab.grading.run` starts them with `launch(program)`.

- `ranks`: the program of each rank of labs 2-4: its link to the check's process (which computes
  the collectives and logs the traffic), then one harness's `run` on the answer;
- `cases`: the program of the single-process checks (labs 1, 3, 6 and 7): one harness's `run` on
  every case;
- the harnesses, one a check: `ring` (lab 2), `tp`, `ddp`, `ring_attn` and `dispatch` (lab 3),
  `zero1`, `zero2` and `ddp_accum` (lab 4), `stream`, `link_rate` and `disk` (lab 6), `sac` and
  `chunk_ce` (lab 7), `accum` and `inplace` (lab 1);
- `common`: what they share (the answer's own module, the answer packages blocked, the MLP of the
  DDP and ZeRO-2 checks, the count of what a process holds).
"""
