"""Data movement, worker side: host slab <-> engine KV blocks, and the pipeline that stages lower tiers.

Owns: :mod:`.engine` (the TransferEngine: owns the host slab and the copier), :mod:`.host_slab`
(the host tier's memory) and :mod:`.pinning` (its page-locking on CUDA), :mod:`.device` (the
copier contract), :mod:`.host_copier`, :mod:`.host_gather`, :mod:`.cuda_copier` (the copiers),
:mod:`.copiers` (picks one), :mod:`.copy_plan` (a job as byte runs, every copier's plan) and its
CUDA executors :mod:`.cuda_batch`, :mod:`.cuda_driver_batch`, :mod:`.pinned_ring`,
:mod:`.pipeline` (a load or store job across tiers), :mod:`.huge_pages`.
May import: tiercache.layout, tiercache.backend, tiercache.faults, tiercache.config, tiercache.tiers.
Not manager/ (it executes plans, never decides), not pd/, not vLLM (except vLLM's optional
batched copy op, looked up at run time in :mod:`.cuda_batch`).
"""
