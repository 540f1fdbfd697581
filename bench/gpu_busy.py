"""How busy the GPU was while a block ran, read the way nvidia-smi reads it.

`nvidia-smi --query-gpu=utilization.gpu -lms N` prints, every N ms, the percentage of the driver's last sample
period in which a kernel was running. `GpuBusy` runs it in the background while its block runs and keeps the
readings; without nvidia-smi (a CPU machine) it reads nothing and its summary says so.

    with GpuBusy() as busy:
        ...
    busy.summary()  # {"readings": 41, "mean_percent": 37.2, "at_most_20_percent": 0.54}
"""
from __future__ import annotations

import shutil
import subprocess
import threading


class GpuBusy:
    def __init__(self, interval_ms: int = 200):
        self.interval_ms = interval_ms
        self.readings: list[float] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GpuBusy":
        if shutil.which("nvidia-smi") is None:
            return self
        self._process = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                self.readings.append(float(line.strip().split(",")[0]))
            except ValueError:
                pass  # a header or a "[N/A]" reading

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._reader.join(timeout=10)

    def summary(self) -> dict | None:
        """None where nothing was read (no nvidia-smi)."""
        if not self.readings:
            return None
        return {"readings": len(self.readings),
                "mean_percent": round(sum(self.readings) / len(self.readings), 1),
                "at_most_20_percent": round(sum(r <= 20 for r in self.readings) / len(self.readings), 3)}
