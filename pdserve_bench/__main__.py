from pdserve_bench.cli import main

raise SystemExit(main())
