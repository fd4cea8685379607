"""What every room of the store uses: the process-wide thread pools (:mod:`.pools`), the
pipeline's sizes (:mod:`.tuning`), the trace hook (:mod:`.tracing`), split futures
(:mod:`.completion`) and a wait that Ctrl-C does not cut short (:mod:`.interrupts`). It
imports nothing else of the store."""
