"""Dense streaming: every layer, whole, every time (the behaviour before the policy seam existed)."""

from __future__ import annotations

from ntio.policies.base import LoadPolicy


class DensePolicy(LoadPolicy):
    """Reads every byte of every layer; observes nothing."""
