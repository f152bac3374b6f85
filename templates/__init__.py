# Installed as the package `tsgen.templates` (see pyproject.toml) so that a
# plain `pip install .` ships the Jinja2 templates and CUDA headers.
