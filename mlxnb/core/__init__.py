"""The continuous-batching engine: the loop side here, the MLX side in `worker/`.

    core/                 loop side: plain Python, no MLX
      engine.py           Engine: rows in, worker results applied, step records
      submitting.py       a prompt checked, encoded, its constraint compiled, queued
      reports.py          a tick's report applied to the rows (the one place it touches a Row)
      scheduler.py        admission: FIFO under max_batch and the KV budget
      rows.py  run.py     a row's record and the result handle over several rows
      rowtrace.py         a row's life as phase records, and why it waited in the queue
      adapters.py         named LoRA/DoRA adapters over the one base model (loop side)
      messages.py         what crosses to the worker and back (typed, plain values)
      states.py           row states and finish reasons
      constrain.py        structured rows: the compiler (llguidance), checks before submitting
      constraint_params.py  constraint_results.py   their values; what a finished row says
      schema_walk.py      a JSON schema as llguidance reads it: masked parts, refs, copies
      constraint_grammar.py  a constraint as llguidance's grammar text
      constraint_probe.py    its first tokens walked: refused before any row takes it
      prompts.py  options.py  closing.py  protocol.py  _threads.py  _trace.py
    core/worker/          the MLX worker thread: the model, caches, every array
      batch.py            BatchExecutor.tick: join, launch, prefill, read back
      membership.py       rows leaving and joining the running batch
      prefill.py          admitted rows' prompts, in groups (prefill_policy.py: how much a tick)
      caches.py  windows.py  quantized_kv.py   every cache kind, batched
      sampling.py  decoding.py  masks.py
      readback.py  prefix.py  fuse.py  inflight.py  warmup.py  stepsplit.py
      setup.py  loadchecks.py   a model's load: its checks, kernels and compiled steps
      tokens.py           one integer type for token ids and row indices
      speculate.py  specpolicy.py  steptimes.py  verify.py  wide.py   speculative decoding:
      lookup.py  draft.py  draftrule.py  rollback.py  roll.py   when, two ways, drafts, rollback
      adapters.py  lowrank.py  gathered.py   rows with different LoRA/DoRA adapters
      recurrent.py  gated_delta.py  short_conv.py   hybrid models' recurrent layers, compiled
      gated_delta_prefill.py   a delta-net's prompt chunk as one kernel
      kv_attention.py  kv_kernels.py  kv_onekey.py  wideattn.py  wide_kernel.py  qk_rope.py
      rows_gemv.py  lowrank_kernels.py  GPU kernels (`mx.fast.cuda_kernel`), each self-checked at load
      kernels_ahead.py  calls_ahead.py  precompile.py  compilers.py   CUDA kernels compiled ahead, in processes
      own_kernels.py      this package's kernels, compiled meanwhile in the engine's process
      kernel_files.py     this package's CUDA kernels kept where MLX reads compiled kernels

Threads. MLX keeps arrays on thread-local streams, so the rule is about threads:

* The worker (`_threads.mlx_worker`: one thread per process, shared by every
  engine) is the only thread that builds, evaluates or reads MLX arrays once a
  model is loaded. Everything in `worker/` runs there, as jobs the loop queues:
  a tick, a warm-up step, a close, `Engine.worker_state`.
* The event loop (the kernel's) owns rows, the scheduler, runs and listeners. It
  hands the worker `Admit`s and cancelled row ids and reads back only what a tick
  returns (`messages.TickReport`) and the plain values measured at load
  (`Engine.cache_kinds`, `layer_costs`); it never touches a worker object's fields.
* The compiled steps and kernels an engine puts on a model take only the worker's
  calls (setup.py `recurrent_ok`, rows_gemv's installing thread): MLX keeps traces
  per thread and forgets a freed function's on one thread only, so a function
  called from two threads can leave a trace that a later one replays. The model's
  other callers, and all once its engines are gone, run mlx-lm's code.
* Two other threads make MLX arrays, and hand them over whole:
  the model loader (`_threads.load_bounded`) creates the weights with mlx_lm.load
  before the worker first sees the model; and the mask fill threads
  (`worker/masks.py`) each copy one host bitmask into an array (`mx.array`, no
  graph, no other array read) that only the worker reads, after it has joined
  their futures. They also advance llguidance matchers, which the worker reads
  only after that join.
* `constrain.Constraints` holds no MLX arrays and locks its own caches: a thread
  of its own compiles and probes each new constraint (the loop waits for it at
  most briefly), the loop checks finished texts with it, the worker copies
  matchers from it.

tests/test_layout.py checks the import side of this: no loop-side module imports
mlx, and nothing in `worker/` imports the loop side's engine.
"""
