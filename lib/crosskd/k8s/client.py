"""The Kubernetes API client of a launcher: from the pod's service account inside a cluster,
else from the kube-config."""

from __future__ import annotations

import os

from kubernetes import client as k8s


def api_client() -> k8s.ApiClient:
    """A client from the pod's service account inside a cluster, else from the kube-config
    (``$KUBECONFIG`` as it is now, else ``~/.kube/config``)."""
    # lazy: kubernetes.config reads files only when a client is wanted
    from kubernetes import config as kube_config

    configuration = k8s.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)
    except kube_config.ConfigException:
        # the client reads $KUBECONFIG once, when imported: give it the current one
        kube_config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return k8s.ApiClient(configuration)
