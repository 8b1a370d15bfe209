"""Running ``crosskd train`` on Kubernetes as a Kubeflow Training Operator PyTorchJob.

:mod:`crosskd.k8s.job` builds the one PyTorchJob spec (the launcher submits it, the kustomize
base under ``manifests/`` is generated from it); :mod:`crosskd.k8s.cli` is ``crosskd job ...``.
"""
