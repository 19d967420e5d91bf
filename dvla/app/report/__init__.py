"""``dvla report RUN_DIR``: plots and a text summary of a run (:mod:`dvla.app.report.make`;
what it reads: :mod:`~dvla.app.report.data`; the plots, the Gantt chart and the summary in
:mod:`~dvla.app.report.plots`, :mod:`~dvla.app.report.gantt`, :mod:`~dvla.app.report.summary`)."""

from dvla.app.report.make import main, make_report

__all__ = ["main", "make_report"]
