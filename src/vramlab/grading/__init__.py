"""The checks that the labs' test cells call. A failing check raises AssertionError with a message
that says what is wrong and why, so that the autograder's feedback teaches.

One module a chapter, named like the course's calculator modules:

- `memory` (lab 1): check_int, diagnose_param_count, check_accumulate, check_reserved_after, check_inplace_mlp;
- `collectives` (lab 2): check_ring_all_reduce;
- `parallel` (lab 3): check_one_f_one_b, check_tp_mlp, check_bucketed_ddp, check_ring_attention,
  check_dispatch;
- `zero` (lab 4): check_zero1, check_zero2, check_accumulate_ddp;
- `offload` (lab 6): check_stream_pass, check_fewest_resident, check_stream_forward, check_link_GBps,
  check_forward_from_disk;
- `checkpointing` (lab 7): check_checkpoint_choice, check_sac_policy, sac_measure, check_chunked_ce;
- `compression` (lab 8): check_row_int8, check_lora_layer, check_distill_loss, check_mask_2_4,
  check_int8_decomposition, check_qlora_bytes, check_moe_ffn, check_prefix_attention, check_prefix_count.

A graded answer's code never runs in the checking process: `run` starts the processes it runs in
(inside the grader's sandbox, `run.SANDBOX_PREFIX`, under its limits, `run.RANK_LIMITS`) and, for
labs 2-4's ranks, connects them through its `Switchboard`; `programs` holds what those processes run,
real modules copied into each process's folder (no vramlab there). The checks may use the pure
calculators of `vramlab` (never `vramlab.measure` or `vramlab.present`).
"""
