"""GPU interconnect discovery for placement: which pairs of this host's visible GPUs share
NVLink, a PCIe switch or only the CPU, from NVML (``pynvml``) or ``nvidia-smi topo -m``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_GPU_COL_RE = re.compile(r"^GPU\d+$")


def parse_nvidia_smi_topo(text: str) -> list[list[str]]:
    """The GPU x GPU matrix of ``nvidia-smi topo -m`` output.

    NIC rows and columns, the CPU/NUMA affinity columns and the legend are dropped.
    Returns ``[]`` when the text holds no GPU table; raises ``ValueError`` when a GPU
    row is shorter than the header says.
    """
    lines = [_ANSI_RE.sub("", ln).rstrip() for ln in text.splitlines()]
    n = 0
    rows: dict[int, list[str]] = {}
    for ln in lines:
        tokens = ln.split()
        if not tokens:
            continue
        if n == 0:
            # The header: GPU0 GPU1 ... then NICs and affinity columns.
            lead = 0
            while lead < len(tokens) and _GPU_COL_RE.match(tokens[lead]):
                lead += 1
            if lead and lead == len([t for t in tokens if _GPU_COL_RE.match(t)]):
                n = lead
            continue
        if tokens[0].lower().startswith("legend"):
            break
        if _GPU_COL_RE.match(tokens[0]):
            cells = tokens[1:1 + n]
            if len(cells) < n:
                raise ValueError(f"nvidia-smi topo: row {tokens[0]} has {len(cells)} GPU cells, expected {n}")
            rows[int(tokens[0][3:])] = cells
    if n == 0 or not rows:
        return []
    if sorted(rows) != list(range(n)):
        raise ValueError(f"nvidia-smi topo: GPU rows {sorted(rows)} do not match {n} GPU columns")
    return [rows[i] for i in range(n)]


def _visible_subset(matrix: list[list[str]]) -> list[list[str]]:
    """Restrict a machine-wide matrix to CUDA_VISIBLE_DEVICES when it lists plain indices."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not vis or not matrix:
        return matrix
    try:
        idx = [int(v) for v in vis.split(",") if v.strip()]
    except ValueError:  # UUIDs or MIG names: cannot map, keep the whole machine
        return matrix
    if not idx or any(i < 0 or i >= len(matrix) for i in idx):
        return matrix
    return [[matrix[i][j] for j in idx] for i in idx]


def _links_from_nvml() -> list[list[str]] | None:
    import pynvml  # optional dependency

    ancestor = {  # nvmlGpuTopologyLevel_t -> nvidia-smi's abbreviations
        getattr(pynvml, "NVML_TOPOLOGY_INTERNAL", 0): "X",
        getattr(pynvml, "NVML_TOPOLOGY_SINGLE", 10): "PIX",
        getattr(pynvml, "NVML_TOPOLOGY_MULTIPLE", 20): "PXB",
        getattr(pynvml, "NVML_TOPOLOGY_HOSTBRIDGE", 30): "PHB",
        getattr(pynvml, "NVML_TOPOLOGY_NODE", 40): "NODE",
        getattr(pynvml, "NVML_TOPOLOGY_SYSTEM", 50): "SYS",
    }
    pynvml.nvmlInit()
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]

        def bus(pci) -> str:
            b = pci.busId
            return (b.decode() if isinstance(b, bytes) else str(b)).lower()

        buses = [bus(pynvml.nvmlDeviceGetPciInfo(h)) for h in handles]
        max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
        remote: list[list[str]] = []  # per GPU, the bus id at the far end of each active link
        for h in handles:
            ends = []
            for link in range(max_links):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != getattr(pynvml, "NVML_FEATURE_ENABLED", 1):
                        continue
                    ends.append(bus(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)))
                except pynvml.NVMLError:
                    break  # past the last link this GPU has
            remote.append(ends)
        ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
        nvlink_caps = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
        matrix = []
        for i in range(n):
            row = []
            for j in range(n):
                if i == j:
                    row.append("X")
                    continue
                direct = sum(1 for b in remote[i] if b == buses[j])
                if direct:
                    row.append(f"NV{direct}")
                    continue
                try:
                    p2p = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], nvlink_caps) == ok
                except pynvml.NVMLError:
                    p2p = False
                if p2p and remote[i]:  # linked through NVSwitch: all of i's links lead there
                    row.append(f"NV{len(remote[i])}")
                else:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    row.append(ancestor.get(level, "SYS"))
            matrix.append(row)
        return matrix
    finally:
        pynvml.nvmlShutdown()


def _links_from_nvidia_smi(timeout_s: float = 5.0) -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s, check=True)
    return parse_nvidia_smi_topo(out.stdout) or None


def gpu_links() -> list[list[str]] | None:
    """The link matrix between this machine's (visible) GPUs, or None if unknown."""
    for probe in (_links_from_nvml, _links_from_nvidia_smi):
        try:
            m = probe()
        except Exception:  # noqa: BLE001 (missing module, driver, tool, timeout, odd output)
            continue
        if m:
            return _visible_subset(m)
    return None
