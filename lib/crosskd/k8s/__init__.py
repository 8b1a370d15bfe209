"""Running ``crosskd train`` on Kubernetes as a Kubeflow Training Operator PyTorchJob or a
Kubeflow Trainer v2 TrainJob.

:mod:`crosskd.k8s.job` builds the one PyTorchJob spec and :mod:`crosskd.k8s.trainjob` the
TrainJob of the same config (the launcher submits either, the kustomize trees under
``manifests/`` are generated from them); :mod:`crosskd.k8s.cli` is ``crosskd job ...``.
"""

JOB_KINDS = ("pytorchjob", "trainjob")
"""The cluster APIs a training run can be submitted to: ``pytorchjob`` (the Training Operator
v1, ``kubeflow.org/v1``) or ``trainjob`` (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``,
on the ``crosskd-torch`` TrainingRuntime)."""
