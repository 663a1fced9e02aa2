"""Metronome's test support: what tests/ and the scripts in hack/ import to run the system on one machine.

    localcluster/       a real control plane on 127.0.0.1 (etcd, kube-apiserver, controller-manager, scheduler,
                        kwok fake GPU nodes), built from Go modules by hack/build-tools.sh
    standin/            the kubelet's stand-in: a real `metronome serve` on 127.0.0.x for every Running server pod
    closedloop/         the closed loop of tests/e2e and hack/demo.py: long-short load, the CPU run's TBT target
    chart.py            the chart installed, the CRD applied, a kubeconfig with the chart's ServiceAccount token
    operator_process.py the operator as a local process under that identity (integration, e2e, the demo)
    endpoint_picker.py  the Gateway API Inference Extension's endpoint picker as a local process (hack/build-picker.sh)
    ext_proc.py         asks a picker where a request goes, over Envoy's ext_proc gRPC API, as a gateway does
    kube_objects.py     reading API objects in tests: an object or None, a condition, an object's Events
    images/             the server and operator images with podman (`make images`, tests/integration)
    checkout.py         where the checkout's files are (the chart, the CRD, the examples, hack/)
    lifetime.py         children that die with their driver
    moe_cases.py        tiny MoE blocks of each family built by transformers, and the routing cases MoE tests run
    polling.py, s3_server.py, hub_server.py, random_batch.py: small fixtures several test folders share

A distribution of its own (tests/support/pyproject.toml), installed editable by `make venv` and never shipped with
the product. Importing this package imports nothing.
"""
