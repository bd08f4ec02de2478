"""The validation report's score plot: its version axis shows whole versions only."""

from __future__ import annotations

import pytest

from kb_reindex.reports import score_figure


@pytest.mark.parametrize("count", [1, 2, 3, 12, 30])
def test_score_plot_ticks_only_whole_versions(count: int) -> None:
    """Seen: one or two versions were labelled 0.950, 0.975, 1.000 ... by matplotlib's default locator."""
    import matplotlib.pyplot as plt

    history = [{"version": n, "hit_rate": 0.9, "mrr": 0.8} for n in range(1, count + 1)]
    figure = score_figure("kb", history, k=4, min_hit_rate=0.9)
    try:
        figure.canvas.draw()
        axis = figure.axes[0]
        low, high = axis.get_xlim()
        ticks = [t for t in axis.get_xticks() if low <= t <= high]
        labels = [label.get_text() for label in axis.get_xticklabels() if low <= label.get_position()[0] <= high]
    finally:
        plt.close(figure)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert set(ticks) <= set(range(1, count + 1))
    assert labels == [f"v{int(t)}" for t in ticks]
    if count <= 12:
        assert ticks == list(range(1, count + 1))  # every version named when they fit
