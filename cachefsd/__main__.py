from cachefsd.cli import main

raise SystemExit(main())
