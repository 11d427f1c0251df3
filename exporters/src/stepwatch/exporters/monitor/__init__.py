"""The monitor: :class:`~stepwatch.exporters.StepMonitor` and what it is made of.

``_monitor`` composes a monitor from its parts and exports its windows; ``_cadence`` says when
the export thread exports, ``_account`` keeps the monitor's own account (``MonitorStats``).
Nothing here is public: users import from ``stepwatch.exporters``.
"""
