"""Reading fp8train's state: the public readers (`synchronize`, `reduction_stats`) and a small view of
the amax protocol's state for tests, telemetry and benchmarks (docs/design.md, section 3).

The views read the live state through a narrow surface (what a test or a dashboard needs: the
storage of an amax group's direction, its members, reductions pending and in flight, roles recorded
so far); nothing here changes training except `reset()` and `DirectionView.complete()`, which do what
their names say. They live in the protocol (`amax/views.py`); this is their public name.
"""

from .amax import views

KEPT_REGIONS = views.KEPT_REGIONS
AmaxGroupView = views.AmaxGroupView
DirectionView = views.DirectionView
RegionView = views.RegionView
amax_group = views.amax_group
amax_groups = views.amax_groups
counters = views.counters
current_region = views.current_region
live_regions = views.live_regions
open_regions = views.open_regions
reduction_stats = views.reduction_stats
regions_owing_backward = views.regions_owing_backward
reset = views.reset
reset_reduction_stats = views.reset_reduction_stats
synchronize = views.synchronize

__all__ = views.__all__
