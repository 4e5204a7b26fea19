from examples.train.cli import main

raise SystemExit(main())
