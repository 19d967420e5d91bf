"""Start-up planning: which ranks share a host (``launch.topology``), who learns, who
samples and how data and weights travel (``launch.placement``), and what that costs on
a cluster (``launch.cluster_model``, the ``dvla plan`` model).

Not to be confused with ``dvla.launch``, the torchrun entry point.
"""

from launch.placement import BroadcastTree, Placement, format_placement, place
from launch.gpu_links import parse_nvidia_smi_topo
from launch.topology import HostInfo, Topology, describe, discover, from_spec, local_info

__all__ = ["BroadcastTree", "HostInfo", "Placement", "Topology", "describe", "discover", "format_placement",
           "from_spec", "local_info", "parse_nvidia_smi_topo", "place"]
