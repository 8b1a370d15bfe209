"""The KFP components of crosskd, one folder per step (``<step>/component.py``): each a thin
shell over one function of :mod:`crosskd.steps`. Only the standard library and ``kfp`` are
imported at module top; ``crosskd`` is imported inside the component's body, in the image.

Each component's image is read when it is imported: ``CROSSKD_IMAGE`` (default
``ghcr.io/crosskd/crosskd:0.1.0``), and ``CROSSKD_CUDA_IMAGE`` (default ``$CROSSKD_IMAGE-cuda``)
for the GPU steps; ``crosskd pipeline compile --image ...`` sets both."""
