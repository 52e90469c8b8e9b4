"""Tools behind ``omniserve register-model``, ``unregister-model`` and ``models``.

``interface`` (import a plugin's classes and check their hooks), ``check`` / ``check_runs`` /
``report`` (``--check`` on a real checkpoint), ``reference`` (transformers' greedy outputs, also
used by the fidelity tests), ``checkpoints`` (a checkpoint under a plugin's architecture name),
``scaffold`` (a plugin package to edit) and ``commands`` (what the CLI calls). The server never
imports anything here (the layering test checks it); the registry file they write is
``omniserve.user_registry``, which ``omniserve.plugins.load_plugins`` reads in every process.
"""
