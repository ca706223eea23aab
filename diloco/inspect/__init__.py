"""Read-side tools: audit, report, gc, plot, timeline."""
