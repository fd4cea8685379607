"""What every room of the store uses: the process-wide thread pools (:mod:`.pools`), the
pipeline's sizes (:mod:`.tuning`), the trace hook (:mod:`.tracing`) and split futures
(:mod:`.completion`). It imports nothing else of the store."""
