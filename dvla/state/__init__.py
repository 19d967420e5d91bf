"""A run's state on disk: checkpoints (:mod:`dvla.state.checkpoint`) with the optimizer's and
the random generators' state (:mod:`dvla.state.train_state`), trained weights read back into a
policy (:mod:`dvla.state.init_weights`), crash-safe writes (:mod:`dvla.state.atomic_io`) and
run directories (:mod:`dvla.state.rundir`)."""
