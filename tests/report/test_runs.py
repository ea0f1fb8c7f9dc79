"""Tables and plots of finished runs (megatron_kd/report)."""
from megatron_kd.report.runs import plot_curves


def test_the_plot_keeps_its_legends_off_the_curves(tmp_path):
    """Nothing drawn in an axes can run through its legend (the teacher's CE line ran through its own entry)."""
    rows = {"teacher": {"ce": 2.24}, **{k: {"ce": 4.0, "kl": 1.3} for k in ("offline", "online", "ce")}}
    fig = plot_curves(str(tmp_path), str(tmp_path / "p.png"), rows)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    for ax in fig.axes:
        legend, box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not legend.overlaps(box), (ax.get_title(), legend, box)
    assert (tmp_path / "p.png").stat().st_size > 10_000
