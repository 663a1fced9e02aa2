"""The Metronome operator: CRD reconciliation, builders, the SLO controller and its Prometheus source. No torch."""
