"""The crosskd pipeline graph(s) (``distill.py``) and their compiled YAML."""
