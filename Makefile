# Build and install icheck like an HPC library.
#
#   make                          build (cargo, release)
#   make install PREFIX=/opt/icheck
#       bin/icheck, lib/libicheck.{so,a} (no MPI inside), lib/libicheck_mpi.a
#       (icheck_init, compiled here with your mpicc: MPI=whatever mpicc is),
#       lib/libicheck_f.a (Fortran module procedures), include/icheck.h,
#       include/icheck.mod, lib/pkgconfig/icheck.pc, lib/cmake/icheck/
#       (find_package(icheck): icheck::icheck, icheck::fortran),
#       share/man/man1/icheck*.1, bash/zsh/fish completions; stripped, with their debug
#       info in bin/.debug/icheck.debug and lib/.debug/libicheck.so.debug
#
# Then: mpicc app.c $(pkg-config --cflags --libs icheck)
#       mpifort app.f90 $(pkg-config --cflags --libs icheck)
#   or: find_package(icheck) + target_link_libraries(app icheck::icheck)
# (with PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig for a prefix outside /usr/local)

PREFIX ?= /usr/local
CARGO ?= cargo
FC ?= gfortran
MPICC ?= mpicc
CARGO_TARGET_DIR ?= target
# Cargo profile of `make build`: release, or dev for a quick debug build.
PROFILE ?= release
# FORTRAN=no leaves out the Fortran module (icheck.mod, libicheck_f.a).
FORTRAN ?= yes
# Where the built files are; `make install-files OUT=target/debug` installs a
# debug build without building (the tests do this).
OUT ?= $(CARGO_TARGET_DIR)/$(if $(filter dev,$(PROFILE)),debug,$(PROFILE))
FORTRAN_LIB := $(if $(filter yes,$(FORTRAN)),-licheck_f)
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

.PHONY: all build install install-files uninstall

all: build

build:
	$(CARGO) build --profile $(PROFILE) -p icheck-ffi -p icheck-service --bin icheck

install: build install-files

install-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include
	install -m 755 $(OUT)/icheck $(DESTDIR)$(PREFIX)/bin/icheck
	install -m 755 $(OUT)/libicheck.so $(DESTDIR)$(PREFIX)/lib/libicheck.so
	install -m 644 $(OUT)/libicheck.a $(DESTDIR)$(PREFIX)/lib/libicheck.a
	# Debug info goes into separate files under .debug/, where gdb finds
	# them through the debuglink; the installed binary and libraries are
	# stripped of it (the release libicheck.so is 41 MB with it).
	install -d $(DESTDIR)$(PREFIX)/bin/.debug $(DESTDIR)$(PREFIX)/lib/.debug
	for f in bin/icheck lib/libicheck.so; do \
	  dir=$$(dirname $(DESTDIR)$(PREFIX)/$$f) && name=$$(basename $$f) && \
	  objcopy --only-keep-debug $$dir/$$name $$dir/.debug/$$name.debug && \
	  objcopy --strip-debug --add-gnu-debuglink=$$dir/.debug/$$name.debug $$dir/$$name || exit 1; \
	done
	strip --strip-debug $(DESTDIR)$(PREFIX)/lib/libicheck.a
	install -m 644 include/icheck.h $(DESTDIR)$(PREFIX)/include/icheck.h
	tmp=$$(mktemp -d) && \
	  if [ "$(FORTRAN)" = yes ]; then \
	    $(FC) -c include/icheck.f90 -J $$tmp -o $$tmp/icheck_f.o && \
	    install -m 644 $$tmp/icheck.mod $(DESTDIR)$(PREFIX)/include/icheck.mod && \
	    ar rcs $(DESTDIR)$(PREFIX)/lib/libicheck_f.a $$tmp/icheck_f.o || exit 1; \
	  fi && \
	  $(MPICC) -O2 -fPIC -Iinclude -c icheck-ffi/c/icheck_mpi.c -o $$tmp/icheck_mpi.o && \
	  ar rcs $(DESTDIR)$(PREFIX)/lib/libicheck_mpi.a $$tmp/icheck_mpi.o && \
	  rm -rf $$tmp
	printf '%s\n' \
	  'prefix=$(PREFIX)' \
	  'libdir=$${prefix}/lib' \
	  'includedir=$${prefix}/include' \
	  '' \
	  'Name: icheck' \
	  'Description: client library of the icheck RDMA checkpoint service' \
	  'Version: $(VERSION)' \
	  'Cflags: -I$${includedir}' \
	  'Libs: -L$${libdir} -Wl,-rpath,$${libdir} $(FORTRAN_LIB) -licheck_mpi -licheck' \
	  'Libs.private: -lfabric -lpthread -ldl -lm' \
	  > $(DESTDIR)$(PREFIX)/lib/pkgconfig/icheck.pc
	# Manual pages and shell completions, generated from the command's
	# own definitions so they never disagree with --help.
	$(OUT)/icheck man --out-dir $(DESTDIR)$(PREFIX)/share/man/man1
	install -d $(DESTDIR)$(PREFIX)/share/bash-completion/completions $(DESTDIR)$(PREFIX)/share/zsh/site-functions \
	  $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d
	$(OUT)/icheck completions bash > $(DESTDIR)$(PREFIX)/share/bash-completion/completions/icheck
	$(OUT)/icheck completions zsh > $(DESTDIR)$(PREFIX)/share/zsh/site-functions/_icheck
	$(OUT)/icheck completions fish > $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/icheck.fish
	install -d $(DESTDIR)$(PREFIX)/lib/cmake/icheck
	for f in icheckConfig icheckConfigVersion; do \
	  sed 's/@VERSION@/$(VERSION)/g' packaging/cmake/$$f.cmake.in > $(DESTDIR)$(PREFIX)/lib/cmake/icheck/$$f.cmake || exit 1; \
	done
	@echo "installed under $(PREFIX); use: pkg-config --cflags --libs icheck, or CMake's find_package(icheck)"

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/icheck $(DESTDIR)$(PREFIX)/lib/libicheck.so $(DESTDIR)$(PREFIX)/lib/libicheck.a \
	  $(DESTDIR)$(PREFIX)/lib/libicheck_f.a $(DESTDIR)$(PREFIX)/lib/libicheck_mpi.a $(DESTDIR)$(PREFIX)/include/icheck.h \
	  $(DESTDIR)$(PREFIX)/include/icheck.mod $(DESTDIR)$(PREFIX)/lib/pkgconfig/icheck.pc \
	  $(DESTDIR)$(PREFIX)/bin/.debug/icheck.debug $(DESTDIR)$(PREFIX)/lib/.debug/libicheck.so.debug
	rm -rf $(DESTDIR)$(PREFIX)/lib/cmake/icheck
	rm -f $(DESTDIR)$(PREFIX)/share/man/man1/icheck.1 $(DESTDIR)$(PREFIX)/share/man/man1/icheck-*.1 \
	  $(DESTDIR)$(PREFIX)/share/bash-completion/completions/icheck $(DESTDIR)$(PREFIX)/share/zsh/site-functions/_icheck \
	  $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/icheck.fish
