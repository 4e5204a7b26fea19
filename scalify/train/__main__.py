from scalify.train._cli import main

raise SystemExit(main())
