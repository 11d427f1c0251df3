"""Device back ends: timing on the device (CUDA events) and the device's health (NVML).

``_backends`` declares each back end and resolves ``device_timer=`` and ``health=`` (``"auto"``
asks each in turn); ``_cuda`` times on CUDA events, ``_nvml`` reads NVML. They implement the
Protocols of ``stepwatch.exporters._protocols`` and import nothing of the monitor's. The public
names are ``stepwatch.exporters``' (``DeviceTimer``, ``HealthSource``) and
``stepwatch.exporters.kernels``' (``HealthSampler`` and its backend and records).
"""
