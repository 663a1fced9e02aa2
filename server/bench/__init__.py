"""`metronome bench`: measurements of the server and of the operator's loop, by purpose.

    cli.py        the `metronome bench` command line (argparse only; each command's work is imported when it runs)
    load/         the load core every benchmark shares (workloads, clients, records, runner, stats, results file,
                  tables, figures) and the commands `bench run` and `bench sweep`
    engine/       `bench engine`: the in-process engine against the hardware's floors and against transformers
    robustness/   `bench isolation`, `bench fuzz` and `bench stream-cost`, each against a `metronome serve` it starts
    loop/         `bench loop`: the operator's control loop on real servers, against static configs
    configfile.py a config folder rewritten by the kubelet's `..data` swap (the sweep, the loop, the tests' stand-in)
    processes.py  the local processes the benchmarks start: a free port, a stop by pid, a log's tail
"""
