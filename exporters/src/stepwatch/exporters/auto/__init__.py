"""Auto mode: forward, backward, optimizer and communication timed by hooks on the model.

``StepMonitor.instrument(model, optimizer)`` installs them (``_auto``: the phases and where each
starts and ends); on a device timer each phase is device time (``_auto_device``). The forward's
class swap (``_forward``), the autograd engine's gate (``_engine``, its Python twin
``_engine_gate``) and the optimizer's hooks (``_opthooks``) keep a step's cost low; ``_stack``
names the phase of a step whose phases were not timed. Everything here writes to the monitor's
``StepRecorder``; nothing is public: users reach it through ``stepwatch.exporters``.
"""
