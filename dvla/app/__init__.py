"""The applications: one module (or package) per ``dvla`` command, above the swimlane and the
library (docs/architecture.md). :mod:`dvla.app.cli` dispatches the ``dvla`` command;
:mod:`dvla.app.run` is what the two training applications (:mod:`dvla.app.train`,
:mod:`dvla.app.sft`) share on every rank of a job."""
