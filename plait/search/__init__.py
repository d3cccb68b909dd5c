"""plait.search: the joint strategy search (no torch)."""

from plait.search.explain import explain
from plait.search.search import SearchResult, plan, plan_with_stats

__all__ = ["SearchResult", "explain", "plan", "plan_with_stats"]
