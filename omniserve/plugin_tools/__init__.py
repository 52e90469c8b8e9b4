"""Tools behind ``omniserve register-model``, ``unregister-model`` and ``models``.

``user_registry`` (the user's registry file), ``interface`` (import a plugin's classes and check
their hooks), ``check`` / ``check_runs`` / ``report`` (``--check`` on a real checkpoint),
``reference`` (transformers' greedy outputs, also used by the fidelity tests), ``checkpoints``
(a checkpoint under a plugin's architecture name), ``scaffold`` (a plugin package to edit) and
``commands`` (what the CLI calls). Nothing here is imported by the engine except
``user_registry``, which ``omniserve.plugins.load_plugins`` reads in every process.
"""
