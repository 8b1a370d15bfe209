"""The KFP components of crosskd, one folder per step (``<step>/component.py``): each a thin
shell over one function of :mod:`crosskd.steps`. Only the standard library and ``kfp`` are
imported at module top; ``crosskd`` is imported inside the component's body, in the image.

``IMAGE`` / ``CUDA_IMAGE`` are the images the components run on (``images/``); set
``CROSSKD_IMAGE`` (and ``CROSSKD_CUDA_IMAGE``) before compiling to use your registry's
(``crosskd pipeline compile --image ...`` does)."""

import os

IMAGE = os.environ.get("CROSSKD_IMAGE", "ghcr.io/crosskd/crosskd:0.1.0")
CUDA_IMAGE = os.environ.get("CROSSKD_CUDA_IMAGE", f"{IMAGE}-cuda")
