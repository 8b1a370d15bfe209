"""crosskd: distil a language model into a student whose tokenizer differs (Common-Support
Distillation), as a Kubeflow workflow on Kubernetes."""

__version__ = "0.1.0"
