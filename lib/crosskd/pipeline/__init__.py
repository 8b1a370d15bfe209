"""``crosskd pipeline compile|graph|run-local|submit``: compile the KFP pipeline of
``pipelines/distill.py``, draw it, run it on this machine under ``kfp.local``, or submit it to a
Kubeflow Pipelines server (:mod:`.submit`). kfp is imported only inside these functions (the
``kfp`` extra)."""
