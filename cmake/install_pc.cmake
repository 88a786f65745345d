# Install step (install(CODE) in CMakeLists.txt): write cca-shared.pc from its
# configured template with, unless the prefix installed to is a system one, an
# RPATH to the installed library directory, so that programs linked through
# pkg-config find libcca.so without LD_LIBRARY_PATH. The prefix is known only
# now (`cmake --install --prefix` may differ from the configured one).
# In: CCA_PC_TEMPLATE, CCA_PC_STAGE (a build-tree file), CCA_PC_LIBDIR (relative
# to the prefix), CCA_SYSTEM_PREFIX_REGEX.
file(READ "${CCA_PC_TEMPLATE}" pc)
if(CMAKE_INSTALL_PREFIX MATCHES "${CCA_SYSTEM_PREFIX_REGEX}")
  string(REPLACE "@CCA_PC_RPATH@" "" pc "${pc}")
else()
  string(REPLACE "@CCA_PC_RPATH@" "-Wl,-rpath,${CMAKE_INSTALL_PREFIX}/${CCA_PC_LIBDIR} " pc "${pc}")
endif()
file(WRITE "${CCA_PC_STAGE}" "${pc}")
# (file(INSTALL) adds DESTDIR itself)
file(INSTALL "${CCA_PC_STAGE}" DESTINATION "${CMAKE_INSTALL_PREFIX}/${CCA_PC_LIBDIR}/pkgconfig")
