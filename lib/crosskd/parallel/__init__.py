"""Parallelism, apart from the models and the trainer (as torchtitan keeps ``distributed/``):
what the trainer's student and the sharded teacher share.

* :mod:`~crosskd.parallel.layout`: the ``parallel:`` layout (``dp_replicate``, ``dp_shard``,
  ``cp``, ``tp``), torch-free (the job renderer reads it);
* :mod:`~crosskd.parallel.mesh`: this process's place in a layout, the one mesh type;
* :mod:`~crosskd.parallel.parallelize`: a Hugging Face causal LM spread over a mesh
  (vocabulary-parallel embedding and head, context parallelism, activation checkpointing,
  FSDP2 / HSDP, DDP), and the forward passes of several processes kept in lockstep;
* :mod:`~crosskd.parallel.context`: context parallelism of the attention layers;
* :mod:`~crosskd.parallel.attention`: the attention inputs of packed rows per implementation
  and per kind of layer;
* :mod:`~crosskd.parallel.rendezvous`: how the processes of a job find each other.

The package imports none of them, so ``crosskd.parallel.layout`` stays importable without
torch.
"""
