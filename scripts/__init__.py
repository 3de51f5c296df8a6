"""The project's command-line tools (build, serve, stream, upload, deploy, bench), as a package.

Installed editable by ``make venv`` (``pyproject.toml``), so the scripts import one another as
``scripts.<module>`` and ``llama_engine`` directly; each still runs as ``python scripts/<file>.py``,
and the ones users type are also ``llama-*`` commands (``[project.scripts]`` in pyproject.toml).
"""
